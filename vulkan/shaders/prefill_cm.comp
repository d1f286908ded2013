#version 450
#extension GL_GOOGLE_include_directive : require
#include "prefill_cm.glsl"
