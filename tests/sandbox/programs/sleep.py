import time
def f():
    time.sleep(100)
