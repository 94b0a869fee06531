"""InferX quantization schemes: FP8 W8A8 ("fp8", fp8.py) and MXFP4 (gpt-oss's experts,
mxfp4.py); W4A16 arrives here too. The unquantized default ("none") lives in inferx-core."""
