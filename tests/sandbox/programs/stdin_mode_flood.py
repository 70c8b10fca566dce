import sys
while True: sys.stdout.write('y' * 10 ** 6)
