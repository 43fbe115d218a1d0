"""kvcal's own task names, the one registry: the tasks kvcal runs itself rather than through lm-eval's task code.

They need kvcal's BF16 reference (kl's logits, divergence's trajectory) or documents generated with the model's
tokenizer (passkey), so no engine runs them (kvcal.engines) and lm-eval's own CLI refuses them
(kvcal.evaluate.lm_eval_cli). kvcal.evaluate.tasks resolves them; kvcal.report reads their results. Nothing here
imports anything: every layer may read the names.
"""

from __future__ import annotations

# kvcal's KL-vs-BF16 task (kvcal.evaluate.kl)
KL_TASK = "kl"
# kvcal's passkey tasks (kvcal.evaluate.passkey generates their documents with the model's tokenizer); their
# filler is kl's held-out text. They shadow lm-eval's LIBRA task `passkey` (Russian) of the same name.
PASSKEY_TASKS = ("passkey", "passkey_mc")
# kvcal's divergence tasks (kvcal.evaluate.divergence): task name -> the lm-eval task whose prompts it decodes.
DIVERGENCE_TASKS: dict[str, str] = {
    "divergence": "gsm8k",
    "divergence_gsm8k": "gsm8k",
    "divergence_aime25": "aime25",
    "divergence_gpqa_diamond": "gpqa_diamond_zeroshot",
}
# every task kvcal runs itself
OWN_TASKS: frozenset[str] = frozenset({KL_TASK, *PASSKEY_TASKS, *DIVERGENCE_TASKS})
