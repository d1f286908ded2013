#version 450
#define STORAGE_F16 1
#extension GL_GOOGLE_include_directive : require
#include "prefill.glsl"
