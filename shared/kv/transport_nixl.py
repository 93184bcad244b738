"""placeholder"""
def nixl_available() -> bool:
    return False
