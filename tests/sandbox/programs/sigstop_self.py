import os, signal
def f():
    os.kill(os.getpid(), signal.SIGSTOP)
    return 0
