def f():
    return open(@HOME@ + '/.secret').read()
