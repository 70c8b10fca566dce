def f():
    fs = []
    while True: fs.append(open('/dev/null'))
