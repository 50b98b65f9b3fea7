"""The command-line tools over the bridge, apart from the optimizer's modules: ``lowbit-tree``'s
entry point (:mod:`.cli`), its ``demo`` (:mod:`.demo`: the small GPT the README's first command
trains) and its ``inspect`` (:mod:`.inspect_state`: a checkpoint's states, read without an
optimizer)."""
