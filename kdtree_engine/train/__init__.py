"""Training of the embedded demo model: corpus + tokenizer, K2-family target, DFlash drafter, export.

    data.py          the Python standard library as corpus, the train / held-out split rule, BPE tokenizer
    target_train.py  a differentiable K2-family model (MLA + YaRN, dense first layer, sigmoid-routed MoE)
                     and its time-boxed training loop
    draft_train.py   the DFlash training forward (many [anchor, MASK x (B-1)] blocks per sequence) and loop
    export.py        canonical checkpoint tensors (dense bf16 or INT4 routed experts) and writers

``scripts/train_demo.py`` runs the whole pipeline; ``docs/demo_model.md`` is the model card.
"""
