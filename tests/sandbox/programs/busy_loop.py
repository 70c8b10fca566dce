def f():
    while True: pass
