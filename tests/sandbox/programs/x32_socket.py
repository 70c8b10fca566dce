import ctypes
def f():
    ctypes.CDLL(None).syscall(0x40000000 | 41, 2, 2, 0)
    return 1
