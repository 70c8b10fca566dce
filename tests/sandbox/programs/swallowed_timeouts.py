import time
def f():
    while True:
        try:
            time.sleep(10)
        except BaseException:
            pass
