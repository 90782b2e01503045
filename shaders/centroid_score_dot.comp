#version 450
// centroid_score.glsl with DOT = 1 (see there).
#extension GL_GOOGLE_include_directive : require
#define DOT 1
#include "centroid_score.glsl"
