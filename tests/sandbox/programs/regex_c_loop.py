import re
def f():
    return re.match(r'(a+)+$', 'a'*64 + 'b')
