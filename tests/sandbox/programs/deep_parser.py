def f():
    return eval('(' * 10 ** 6 + ')' * 10 ** 6)
