def f():
    with open('big', 'wb') as fh:
        while True:
            fh.write(b'0' * (1 << 20))
