import os
def f():
    os.abort()
