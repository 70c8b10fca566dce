"""Your reward plug-ins: worked examples of user code, not part of the installed package.

`vapo` imports plug-ins from the folder it runs in, so from the project folder
``--trainer.callbacks+=examples.rewards.short_answer.ShortAnswerBonus`` finds
`examples/rewards/short_answer.py`. The built-in rewards live in `vapo_lightning.rewards`; the
trainer's own callbacks (checkpoints on SIGTERM, the log line, the critic probe) in
`vapo_lightning.callbacks`.
"""
