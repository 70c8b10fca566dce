import socket
def f():
    s = socket.socket(socket.AF_UNIX)
    s.connect('\0vapo-test-@TOKEN@')
    return 'connected'
