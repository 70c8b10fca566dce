import socket
def f():
    s = socket.create_connection(('127.0.0.1', @TCP@), timeout=1)
    s.sendall(b'x')
    return 'connected'
