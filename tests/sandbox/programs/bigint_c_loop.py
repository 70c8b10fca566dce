def f():
    return 7 ** (10 ** 9) % 10
