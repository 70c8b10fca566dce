import socket
def f():
    s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    s.sendto(b'x', ('127.0.0.1', @UDP@))
    return 'sent'
