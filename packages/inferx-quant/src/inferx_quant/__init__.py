"""InferX quantization schemes: FP8 W8A8 ("fp8", fp8.py); W4A16 and MXFP4 arrive here too. The
unquantized default ("none") lives in inferx-core."""
