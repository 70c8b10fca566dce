import os
def f():
    return os.environ.get('VAPO_TEST_SECRET', 'none')
