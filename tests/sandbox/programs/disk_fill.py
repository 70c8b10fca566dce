def f():
    i = 0
    while True:
        with open(f'fill{i}', 'wb') as fh:
            fh.write(b'0' * (15 << 20))
        i += 1
