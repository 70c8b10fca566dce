import os
def f():
    os.kill(os.getppid(), 19)
    return 0
