def f():
    i = 0
    while True:
        open(f'n{i}', 'w').close()
        i += 1
