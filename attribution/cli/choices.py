"""The names the subcommands offer as choices, kept here without torch so that `ntk --help`
and `ntk <command> --help` start fast; tests/test_cli_fast.py checks them against the library's
own tuples."""

KERNEL_KINDS = ("full", "diagonal", "trace", "sum_logits")  # ntk.KINDS
KERNEL_METHODS = ("auto", "jacobian", "ntk_vp", "structured")  # ntk.METHODS
INFLUENCE_METHODS = ("auto", "gauss_newton", "trak", "surrogate", "grad_dot", "ekfac", "kfac")
LAYER_SCORES = (  # attribution.layers.SCORES
    "sensitivity",
    "share",
    "alignment",
    "top_eigenvalue",
    "param_norm",
    "grad_norm",
    "fisher",
    "block_influence",
)
LABEL_SCORES = ("alignment", "grad_norm", "fisher")  # attribution.layers.LABEL_SCORES
DEFAULT_LAYER_SCORE = "sensitivity"
PROXY_METRICS = (  # ntk.proxies.METRICS
    "lga",
    "condition_number",
    "trace",
    "frobenius",
    "mean",
    "lga_cosine",
    "lga_centred",
    "layer_condition",
    "label_condition",
    "descent",
    "naswot",
    "synflow",
    "grad_norm",
    "snip",
    "jacob_cov",
    "params",
    "tse",
)
DEFAULT_RANKING = ("label_condition", "naswot")  # ntk.proxies.DEFAULT_RANKING
RANKING_BATCH_SIZE = 64  # ntk.proxies.RANKING_BATCH_SIZE
RANKING_REPEATS = 2  # ntk.proxies.RANKING_REPEATS
PROJECTORS = ("rademacher", "gaussian", "sparse", "srht")  # projections.PROJECTORS
DEFAULT_PROJECTOR = "rademacher"  # projections.DEFAULT_PROJECTOR
SURROGATE_KINDS = ("full", "trace", "sum_logits")  # attribution.surrogate.KINDS
SURROGATE_MACHINES = (  # attribution.surrogate.MACHINES
    "ridge",
    "svm",
    "logistic",
    "representer",
    "gauss_newton",
)
POSTERIOR_AUTO_MAX = 4096  # attribution._report.POSTERIOR_AUTO_MAX
BATCHING_NOTE = "There is a performance drop"  # ntk.core.persample.BATCHING_NOTE
