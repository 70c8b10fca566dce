import os, time
def f():
    if os.fork() == 0:
        os.setsid()
        time.sleep(600)
    return 1
