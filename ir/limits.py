"""Stated limits on what attnplan accepts, checked where input enters (the API,
the CLI, the mask language, batch files, plan files) so that no input can
make it spend unbounded time or memory. Each limit is far above what a
training cluster uses today; passing one gives one typed error naming it.

Every consumer imports its number from here, so the README's table and the
errors agree.
"""

MAX_TOKENS = 1 << 26            # tokens in one batch (67,108,864; issue 9 plans 4M)
MAX_SAMPLES = 1 << 20           # samples (documents) in one batch
MAX_SEGMENTS = 1 << 22          # segments of all samples of one batch (batch files, plan files)
MAX_DEVICES = 256               # devices of one attention plan (CP group); issue 9 plans up to 256. Ring
                                # traffic moves N^2 blocks (one message per peer and stage; before coalescing,
                                # 1000 devices on 500 tokens made 4.9M instructions: 40 s to plan, 42 s stats)
MAX_HEADS = 1 << 12             # query heads, kv heads
MAX_HEAD_DIM = 1 << 12          # head dimension
MAX_BLOCK_SIZE = MAX_TOKENS     # token block size of the tile pass
MAX_STAGES = 4096               # stages of a divided schedule
MAX_COMPUTE_BLOCKS = 600_000    # compute blocks a pipeline may create (PlanError beyond); per_doc on
                                # lmsys-128k-1 at 32 devices: 452K blocks, 3.6 s, 0.96 GB peak
MAX_TILE_PIECES = 1 << 23       # (tile, mask piece) rows the tiler may expand, counted before it allocates them
MAX_MASK_PIECES = 1 << 22       # canonical mask pieces of one batch
MAX_MASK_TEXT = 1 << 20         # characters of mask text
MAX_MASK_INT = 1 << 62          # |integer literal| in mask text (the pieces' unbounded sentinel)
MAX_MASK_DEPTH = 1 << 14        # parentheses open at once in mask text (deeper: one MaskError at the paren)
MAX_MASK_WORK = 1 << 30         # work units (~ numpy row operations) to evaluate a mask for one parse or batch
MAX_BATCH_FILE = 256 << 20      # bytes of a batch file (JSON / JSONL)
MAX_PLAN_FILE = 256 << 20      # bytes of a plan file on disk
MAX_PLAN_BODY = 512 << 20      # bytes of a plan body after decompression
MAX_INSTRUCTIONS = 1 << 26      # instructions of one program, all devices and phases
MAX_TRANSFERS = 1 << 26         # transfers (blocks moved) of one program, both phases; messages are fewer
MAX_RUN_BYTES = 16 << 30        # bytes of tensors `plan run` may allocate for a check
MAX_PROFILE_FILE = 1 << 20      # bytes of a cost profile JSON (--profile FILE.json; calibrate writes < 1 kB)
MAX_MEMORY_CAP = 1 << 62        # bytes of memory_cap (--memory-cap): far beyond any device
MAX_TIMEOUT_S = 7 * 24 * 3600   # seconds a transfer may wait (--timeout, attention(timeout=))
MAX_REPEATS = 1000              # repeats of one `plan calibrate` measurement
MAX_MASK_WIDTH = 1024           # columns of a `plan mask` picture (4096 took 14 s and 1.5 GB)
MAX_LAYERS = 4096               # layers of a step model (attnplan.step)
MAX_MODEL_DIM = 1 << 24         # hidden size, MLP width and vocabulary of a step model
MAX_MODEL_FILE = 1 << 20        # bytes of a model JSON (--model FILE.json)
MAX_MESH_DEVICES = 1 << 14      # devices of one step's mesh (dp x cp x pp); each attention group <= MAX_DEVICES
MAX_MICRO_BATCHES = 1 << 16     # micro-batches of one step plan
MAX_STEP_FILE = 1 << 30         # bytes of a step plan file on disk (plan step compile -o F.step)
MAX_STEP_BODY = 1 << 30         # bytes of a step plan body after decompression
MAX_PREFETCH = 1024             # workers, and batches in flight (lookahead), of one PlanPrefetcher

__all__ = [n for n in dir() if n.startswith("MAX_")]
