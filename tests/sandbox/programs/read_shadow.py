def f():
    return open('/etc/shadow').read()
