def f():
    x = bytearray(10 ** 11)
    return len(x)
