def f():
    return True
