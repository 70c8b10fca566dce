def f():
    l = []
    while True:
        l.append(' ' * 10 ** 7)
