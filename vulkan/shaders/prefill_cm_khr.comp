#version 450
#define KHR
#extension GL_GOOGLE_include_directive : require
#include "prefill_cm.glsl"
