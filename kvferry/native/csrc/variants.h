/*
 * The variant numbers of the kernels that hold several instruction sets in one build, as
 * their `variant` argument and the bits of their kvf_<name>_variants() mask (the same numbers
 * as VARIANT_CODES in kvferry/native/variants.py).
 */
#ifndef KVF_VARIANTS_H
#define KVF_VARIANTS_H

#define KVF_SCALAR 0
#define KVF_AVX2 1
#define KVF_AVX512 2
#define KVF_AVX512BF16 3
#define KVF_AMX 4

#endif
