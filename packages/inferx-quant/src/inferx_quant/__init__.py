"""InferX quantization schemes: MXFP4 (gpt-oss's experts) so far; FP8 and W4A16 arrive here.
The unquantized default ("none") lives in inferx-core."""
