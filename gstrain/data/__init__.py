"""Scene loading: COLMAP scenes through pycolmap, and the generated demo scene."""
