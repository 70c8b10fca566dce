import os
def f():
    d = open(f'/proc/{os.getppid()}/environ', 'rb').read()
    return d.decode()
