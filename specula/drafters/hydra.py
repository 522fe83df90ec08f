"""`hydra`: a trained hydra head drafting dynamic trees (see `specula.drafters.trained`)."""

from specula.drafters.trained import CONFIG, create_head_drafter  # noqa: F401  (CONFIG: its options)


def create(*, target=None, draft=None, head=None, target_name=None, online_distill=False, head_window=None,
           head_context_vocab=None,
           **options):
    """options: DraftTreeConfig fields (tree_top_k, tree_depth, tree_nodes, tree_sampling, tree_verifier);
    head: the head file (`specula train` / `specula models install`); online_distill: keep training it (OSD)."""
    return create_head_drafter("hydra", target=target, head=head, target_name=target_name,
                               online_distill=online_distill, head_window=head_window,
                               head_context_vocab=head_context_vocab, **options)
