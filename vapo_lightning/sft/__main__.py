"""``python -m vapo_lightning.sft fit -c configs/quickstart_sft.yaml``"""

from vapo_lightning.sft.cli import sft_main

sft_main()
