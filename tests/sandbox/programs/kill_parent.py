import os
def f():
    os.kill(os.getppid(), 9)
    return 0
