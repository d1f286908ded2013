#version 450
#define SHARED_BLOCKS 1
#extension GL_GOOGLE_include_directive : require
#include "prefill_fa.glsl"
