def f():
    while True: print('x' * 10 ** 6)
