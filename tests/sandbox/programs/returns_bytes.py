def f():
    return b'\xff\x00' * 100
