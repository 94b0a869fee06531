"""InferX quantization schemes: FP8 W8A8 ("fp8", fp8.py), MXFP4 (gpt-oss's experts, mxfp4.py)
and W4A16 ("gptq", "awq", w4a16.py). The unquantized default ("none") lives in inferx-core."""
