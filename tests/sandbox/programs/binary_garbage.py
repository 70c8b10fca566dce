import os, sys
sys.stdout.buffer.write(os.urandom(1 << 16))
