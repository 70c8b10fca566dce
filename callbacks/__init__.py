"""Your reward plug-ins: worked examples of user code, not part of the installed package.

`vapo` imports plug-ins from the folder it runs in, so from the project folder
``--trainer.callbacks+=callbacks.short_answer.ShortAnswerBonus`` finds
`callbacks/short_answer.py`. The built-in rewards live in `vapo_lightning.rewards`.
"""
