import ctypes
def f():
    return ctypes.string_at(0)
