#version 450
#define STORAGE_F16 0
#define USE_SUBGROUP 1
#extension GL_GOOGLE_include_directive : require
#include "decode.glsl"
