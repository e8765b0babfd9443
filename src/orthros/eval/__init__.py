"""Evaluation: synthetic recall (MQAR), passkey retrieval, held-out perplexity.

    from orthros.eval.tasks import eval_mqar, eval_passkey, eval_perplexity

`orthros eval MODEL --task mqar passkey ppl` runs them from the command line;
`orthros eval-harness` runs lm-evaluation-harness tasks.
"""
