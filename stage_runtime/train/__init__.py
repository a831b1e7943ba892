"""Training the tiny trained model: a class-conditional DiT drawing handwritten digits, and its judge.

``stage-runtime train-tiny OUT_DIR`` (``make train-tiny``) trains, on CPU with a fixed seed, from scikit-learn's
``load_digits`` (1,797 8x8 digits shipped inside the package: no download):

    digits_data     the digits, split once into training and held-out ones, drawn at 32x32 as dark ink on paper
    vae             a tiny AutoencoderKL (32x32 pixels <-> 4x8x8 latents), trained on the training digits
    dit             a class-conditional DiTTransformer2DModel on those latents (labels "0".."9"), EMA weights
    judge           the digit classifier that scores generated images (stage_runtime.models.tiny.digit_judge)
    recipe          every number of the recipe, in one frozen dataclass
    run             the whole training: the pipeline folder, the judge, the folder digest and the manifest
    command         the CLI: ``stage-runtime train-tiny``

The result ships in ``stage_runtime/models/tiny/trained/`` and serves as the built-in ``tiny-digits``
(docs/trained-model.md). scikit-learn is needed only here (``pip install 'diffstage[train]'``).
"""
