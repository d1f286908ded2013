#version 450
#define STORAGE_F16 0
#extension GL_GOOGLE_include_directive : require
#include "prefill.glsl"
