import os
def f():
    os._exit(0)
